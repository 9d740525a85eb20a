"""The planner: a calibrated cost model of hpcpar's layouts (``hpcpar plan``, docs/planner.md).

``machine`` reads and writes machine files; ``model`` costs a model's layers (work by op
family, activations, messages), ``moe`` an MoE block, ``inventory`` lists the layers in
order; ``traffic`` the exact bytes per step per
communicator; ``memory`` the bytes per rank; ``predict`` one layout's step time; ``layouts``
every layout of a world, ranked; ``calibrate`` measures this machine.
"""
