"""mkdocs-gen-files script: every report page, the reports nav and the assets, from data/."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tilax_report import site  # noqa: E402

site.write_site()
