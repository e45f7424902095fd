"""Sessions: tests, docs, serve, lint (``nox -l`` lists them)."""

import nox

nox.options.default_venv_backend = "venv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]

PYPROJECT = nox.project.load_toml("pyproject.toml")


def install_groups(session: nox.Session, *groups: str) -> None:
    """Install the package (editable) plus the named dependency groups of pyproject.toml."""
    requirements = []
    for group in groups:
        requirements += nox.project.dependency_groups(PYPROJECT, group)
    session.install("-e", ".", *requirements)


@nox.session
def tests(session: nox.Session) -> None:
    """Unit tests (CPU, Pallas interpret mode), site build and browser tests."""
    install_groups(session, "tests", "docs")
    session.run("pytest", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """Build the site from the stored results into site/ (open site/index.html)."""
    install_groups(session, "docs")
    session.run("mkdocs", "build", "--strict", "--site-dir", "site", *session.posargs)


@nox.session
def serve(session: nox.Session) -> None:
    """Build the site and serve it at http://127.0.0.1:8000, rebuilding on changes."""
    install_groups(session, "docs")
    session.run("mkdocs", "serve", "--dev-addr", "127.0.0.1:8000", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the package, generators, tests and this file."""
    session.install(*nox.project.dependency_groups(PYPROJECT, "lint"))
    session.run("ruff", "check", "src", "gen", "tests", "noxfile.py", *session.posargs)
