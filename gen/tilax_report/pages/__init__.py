"""One module per report page, each with ``PATH`` (under docs/), ``TITLE`` (its nav entry) and
``build(results) -> Markdown``.

`PAGES` lists them in nav order: adding a report page is one new module plus one line here; the
site script writes every page in the list and the reports nav (reports/SUMMARY.md, read by
mkdocs-literate-nav) from it.
"""

PAGES = [
    "overview",
    "runs",
    "history",
    "moe_layer",
    "moe_internals",
    "moe_decoder",
    "moe_decode",
    "moe_ep",
    "fp8_convergence",
    "rbf",
    "gp",
    "nn_suites",
    "raw_data",
]
# Hand-written pages in docs/reports/ that the reports nav lists after the generated ones.
HAND_WRITTEN = {"Table schema": "reports/schema.md"}
