"""The discrete-event cluster simulator: the real router and engine cores on a virtual clock.

``loop`` is the clock (a heap with a tested tie-break), ``world`` wires one
``router.core.Router`` and N ``engine.core.EngineCore`` s with a modeled event link, ``runner``
runs policies x schedulers x rates, ``policies`` parses router policy specs.
"""
