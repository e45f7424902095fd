"""The Mosaic GPU backend of the MoE layer (Hopper, sm90+): ``gmm.py`` is the backend's kernel
set (``base.GmmKernels``) and ``common.py`` its tiles and building blocks; each other module
holds one kernel (``gmm_ws``, ``gmm_gather``, ``gmm_rows``, ``gmm_dx``, ``router``,
``shared``), taken where a row of ``tilax.moe.rules`` says."""
