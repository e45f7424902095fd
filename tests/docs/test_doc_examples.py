"""Run every runnable code block of the hand-written docs pages, as a reader would.

A block is runnable when the line right before its opening fence is the HTML comment
``<!-- runnable -->`` and the fence is a ```` ```python ```` fence (see docs/contributing.md).
The runnable blocks of one page run in page order as one script in a fresh Python process,
like a reader who copies them one after another into a file. Pages choose their sizes from
the device (``jax.default_backend()``), so each page runs twice where it can: on the CPU
backend with none of this environment's tilax, JAX, XLA or BLAS settings, where it must need
less than a minute of CPU time (what a reader on a CPU laptop gets), and, on a machine with a
GPU, on the GPU at its GPU sizes.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from doc_blocks import DOCS, MARKER, DocsFormatError, display_name, page_script, runnable_blocks

import tilax

# A reader on a CPU laptop must be able to run a page's code in under a minute. The test
# machine may be busy, so the limit is on the CPU time of the run (user + system, all threads):
# what it needs of a machine of this speed, whatever else runs there. An idle machine takes at
# most that long. The pages need 5-35 s of CPU on a 2-core machine (kernel-sums the most).
CPU_LIMIT_S = 60
# Wall-clock backstops: a CPU run this long is far over its limit anyway (or hung); on a GPU the
# pages run at their GPU sizes.
CPU_WALL_LIMIT_S = 180
GPU_WALL_LIMIT_S = 900
# Settings a reader who copies the code would not have (nox -s tests sets one BLAS thread).
NOT_A_READERS_ENVIRONMENT = ("TILAX_", "JAX_", "XLA_", "OPENBLAS_")

# Pages that must keep at least one runnable block: losing the marker must not silently turn
# the examples of these pages into untested text.
PAGES_WITH_EXAMPLES = ("getting-started.md", "guides/moe.md", "guides/kernel-sums.md",
                       "guides/gp.md")


def pages_with_runnable_blocks() -> list[Path]:
    return [page for page in sorted(DOCS.rglob("*.md")) if runnable_blocks(page)]


def run_page(page: Path, directory: Path, env: dict[str, str], wall_limit_s: float) -> float:
    """Run ``page``'s script in a fresh Python; fail on an error or after ``wall_limit_s``.

    Returns the CPU time (user + system) the run used. The script runs in ``directory``, with
    tilax from the same place as in this process (installed, or the checkout's src/ made
    absolute in PYTHONPATH).
    """
    script = directory / f"page_{page.stem.replace('-', '_')}.py"
    script.write_text(page_script(page), encoding="utf-8")
    tilax_root = str(Path(tilax.__file__).resolve().parents[1])
    env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [tilax_root, env.get("PYTHONPATH")])))
    where = f"docs/{display_name(page)} (run as {script.name}; its line numbers are the page's)"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        proc = subprocess.run([sys.executable, str(script)], cwd=directory, env=env,
                              capture_output=True, text=True, timeout=wall_limit_s)
    except subprocess.TimeoutExpired as timeout:
        stderr = timeout.stderr.decode() if isinstance(timeout.stderr, bytes) else timeout.stderr
        pytest.fail(f"{where} did not finish within {wall_limit_s} s\n{(stderr or '')[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        pytest.fail(f"{where} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def run_page_on_a_cpu(page: Path, directory: Path, cpu_limit_s: float = CPU_LIMIT_S) -> float:
    """Run ``page`` as a reader on a CPU laptop would: the CPU backend, none of the tilax, JAX,
    XLA or BLAS settings of this environment. Fail if it uses more than ``cpu_limit_s`` of CPU."""
    env = {name: value for name, value in os.environ.items()
           if not name.startswith(NOT_A_READERS_ENVIRONMENT)}
    env["JAX_PLATFORMS"] = "cpu"  # what a machine without a GPU gets
    cpu_s = run_page(page, directory, env, CPU_WALL_LIMIT_S)
    if cpu_s > cpu_limit_s:
        pytest.fail(f"docs/{display_name(page)} used {cpu_s:.1f} s of CPU time on the CPU "
                    f"backend, over its limit of {cpu_limit_s} s")
    return cpu_s


@pytest.mark.parametrize("page", pages_with_runnable_blocks(), ids=display_name)
def test_page_runs_on_a_cpu_within_a_minute(page: Path, tmp_path: Path) -> None:
    run_page_on_a_cpu(page, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (the GPU sizes)")
@pytest.mark.parametrize("page", pages_with_runnable_blocks(), ids=display_name)
def test_page_runs_on_the_gpu(page: Path, tmp_path: Path) -> None:
    run_page(page, tmp_path, dict(os.environ), GPU_WALL_LIMIT_S)


def test_page_script_keeps_the_page_line_numbers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"# t\n{MARKER}\n```python\nx = 1\n```\ntext\n"
                    f"!!! note\n    {MARKER}\n    ```python\n    if x:\n        y = 2\n    ```\n",
                    encoding="utf-8")
    script = page_script(page).splitlines()
    assert script[3] == "x = 1" and script[9:11] == ["if x:", "    y = 2"]
    assert [line for i, line in enumerate(script) if i not in (3, 9, 10)] == [""] * 9


def test_a_failing_page_names_its_line(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"# t\n{MARKER}\n```python\nx = 1\n```\n{MARKER}\n```python\n"
                    "assert x == 2, 'wrong x'\n```\n", encoding="utf-8")
    with pytest.raises(pytest.fail.Exception, match=r"(?s)line 8.*wrong x"):
        run_page(page, tmp_path, dict(os.environ), CPU_WALL_LIMIT_S)


def test_a_page_over_its_cpu_limit_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"{MARKER}\n```python\nimport time\n\nwhile time.process_time() < 2:\n"
                    "    pass\n```\n", encoding="utf-8")
    with pytest.raises(pytest.fail.Exception, match=r"used [\d.]+ s of CPU time"):
        run_page_on_a_cpu(page, tmp_path, cpu_limit_s=1)


def test_a_page_over_its_wall_limit_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"{MARKER}\n```python\nimport time\n\ntime.sleep(30)\n```\n",
                    encoding="utf-8")
    with pytest.raises(pytest.fail.Exception, match="did not finish within 1 s"):
        run_page(page, tmp_path, dict(os.environ), 1)


@pytest.mark.parametrize("name", PAGES_WITH_EXAMPLES)
def test_example_pages_keep_runnable_blocks(name: str) -> None:
    assert runnable_blocks(DOCS / name), f"docs/{name} lost its runnable blocks"


def test_marker_must_precede_a_python_fence(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"{MARKER}\n```bash\nls\n```\n", encoding="utf-8")
    with pytest.raises(DocsFormatError, match="must be python"):
        runnable_blocks(page)
    page.write_text(f"{MARKER}\n\n```python\nx = 1\n```\n", encoding="utf-8")
    with pytest.raises(DocsFormatError, match="followed directly"):
        runnable_blocks(page)
    page.write_text(f"{MARKER}\n```python\nx = 1\n", encoding="utf-8")
    with pytest.raises(DocsFormatError, match="never closed"):
        runnable_blocks(page)


def test_blocks_keep_order_lines_and_indentation(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# t\n"
        f"{MARKER}\n```python\nx = 1\n```\n"
        "```python\nnot_run()\n```\n"
        f'!!! note\n    {MARKER}\n    ```python title="a.py"\n    if x:\n        y = 2\n    ```\n'
        f"````markdown\n{MARKER}\n```python\nexample_only()\n```\n````\n",
        encoding="utf-8",
    )
    blocks = runnable_blocks(page)
    assert [(b.line, b.code) for b in blocks] == [(4, "x = 1\n"), (12, "if x:\n    y = 2\n")]
