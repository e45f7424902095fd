"""mkdocs-gen-files script: the report page built by tilax_report.pages.raw_data."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tilax_report import site  # noqa: E402

site.write_page("raw_data")
