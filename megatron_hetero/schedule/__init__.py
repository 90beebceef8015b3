"""Pipeline-schedule rules, pure Python: Megatron's warm-up counts and the per-stage warm-ups of
the heterogeneity-aware 1F1B, the micro-batch groups of the interleaved schedule, and the order
of one rank's forwards and backwards (:mod:`.rules`, :mod:`.order`), and the replicas' shares of a
global batch (:mod:`.shares`). The plan's checks, the cost model, the simulator, the tuner and the
runtime's own schedule (:mod:`megatron_hetero.mcore.warmup_schedule`) and rebalancing all read
them here.
"""
