"""Exact Gaussian-process regression on the kernel sums: ``mll`` and ``posterior``
(see ``tilax.gp.api``)."""

from tilax.gp.api import mll, posterior

__all__ = ["mll", "posterior"]
