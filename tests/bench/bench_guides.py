"""Guide timings (suite ``guide_gp``): the kernel-sums guide's Gaussian-process lengthscale
fit, timed as the guide's own code runs it, so that the guide quotes a stored time per step.

The case runs every runnable block of docs/guides/kernel-sums.md in one namespace, as a reader
who copies them would (the page picks its sizes from the device: 20 000 training points on a
GPU, 1 000 on a CPU; its ``tilax.gp`` section a million points on a GPU), then times one
step of the fit, ``nll_gradient(log_lengthscale, solution)``: one conjugate-gradient solve
warm-started from the fit's last solution plus the product with the kernel's lengthscale
gradient (the optimiser's update is negligible beside it). The row carries the page's
training-set size (``n``) and the solve's iteration count.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

DOCS_TESTS = Path(__file__).resolve().parents[1] / "docs"
GUIDE = "guides/kernel-sums.md"


@dataclasses.dataclass(frozen=True)
class GuideGpCase:
    """The one ``guide_gp`` row (see the module docstring)."""

    priority: int = 50
    numerics: bool = False

    family = "rbf"
    suite = "guide_gp"

    @property
    def id(self) -> str:
        return "guide_gp-rbf-lengthscale-step"

    def extra_info(self) -> dict[str, Any]:
        import jax

        # what the page's impl="auto" runs
        impl = "pallas" if jax.default_backend() == "gpu" else "xla"
        return {"family": "rbf", "suite": "guide_gp", "impl": impl, "dtype": "float32",
                "op": "fwd_bwd", "guide": f"docs/{GUIDE}"}

    def scale_key(self) -> tuple:
        return ("guide_gp",)

    def size_label(self) -> str:
        return "the guide's sizes"

    def work(self) -> float:
        return 1.0

    def rates(self, median_s: float) -> dict[str, float]:
        return {}

    def precheck(self, state) -> str | None:
        return None

    def build(self, state):
        import bench_moe

        if str(DOCS_TESTS) not in sys.path:
            sys.path.insert(0, str(DOCS_TESTS))
        from doc_blocks import DOCS, page_script

        page = DOCS / GUIDE
        namespace: dict[str, Any] = {"__name__": "__guide__"}
        exec(compile(page_script(page), str(page), "exec"), namespace)  # noqa: S102 - the page
        step = namespace["nll_gradient"]

        def inspect(out) -> dict:
            _, _, iterations = out
            return {"n": int(namespace["N_TRAIN"]), "cg_iterations": int(iterations)}

        return bench_moe.JaxWorkload(
            step, (namespace["log_lengthscale"], namespace["solution"]), inspect)


def suite_cases(suite: str, mode: str) -> list[GuideGpCase]:
    return {"guide_gp": lambda mode: [GuideGpCase()]}[suite](mode)
