"""One loader module per stored-file format: NAME, matches(doc), load(doc)."""
