"""The three parallelisms of PTD-P and the step that composes them, over the mesh ("data", "pipe", "tensor").

    mesh.py         the named mesh (tensor innermost) and CPU device simulation
    vma.py          shard_map typing helpers (varying axes, marking values varying)
    sharding.py     every PartitionSpec, and the pipeline's stacked-layer layout [v, p, k, ...]
    tensor.py       tensor parallelism (§2.3): Megatron's f/g, TP layers, vocab-parallel embedding and loss
    pipeline/       pipeline parallelism (§2.2): schedules as data, lockstep ticks, the residual stash, the executor
    step.py         the jit(shard_map) train/eval steps: data parallelism (§2.1) around the other two
    distributed_optimizer.py  Megatron's distributed optimizer (ZeRO-1): state split over data, reduce-scatter

Importing this package imports no JAX; its modules do (except pipeline's pure-Python schedule modules).
"""
