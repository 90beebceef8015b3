"""What a running job measures about itself, against what its plan predicted (pure Python: no
torch; the runtime's collector is :mod:`megatron_hetero.runtime.telemetry`).

``records``     the telemetry files: one :class:`~.records.StepRecord` per reported step in
                ``DIR/telemetry.jsonl`` (measured and predicted figures per stage of each
                replica, named by plan path), read back strictly
``prediction``  the predicted side: the plan simulated with the pool's inventory, or with the
                catalog's figures and the links a plan implies where no inventory is given
``report``      ``megatron-hetero report DIR``: the table, the slow stages, the timelines
"""
