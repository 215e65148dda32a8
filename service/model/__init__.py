"""The DPA4/SeZM energy model: configuration, network, model files, DeePMD import, Potential.

Heavy imports (graph, kernels) happen in the submodules; import what you need from them, e.g.
``from service.model.potential import load_potential``.
"""
