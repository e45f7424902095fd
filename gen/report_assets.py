"""mkdocs-gen-files script: the vendored Vega bundle and the stored files, into the site."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from tilax_report import site  # noqa: E402

site.write_vega_bundle()
site.write_raw_data()
