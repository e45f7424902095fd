"""The RBF kernels on Pallas Mosaic GPU (Hopper): ``common`` (the shared building blocks) and one
module per kernel: ``forward``, ``grad`` (the fast path's), ``exact``, ``exact_grad``
(``precision="highest"``'s)."""
