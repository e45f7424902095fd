"""One module per report page: build(results) -> Markdown."""
