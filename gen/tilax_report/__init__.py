"""Read the stored benchmark results (data/results/) and render the report pages.

`load` reads every stored file into one tidy table (`schema`); `pages` turns the table into
Markdown with Altair charts and pandas tables; the small scripts in gen/ hand those pages to
mkdocs-gen-files.
"""
