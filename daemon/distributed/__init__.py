"""One model across several machines on MLX's distributed runtime (docs/distributed.md).

Rank 0 is the daemon users see (HTTP, control socket, console, scheduler, engine); every other
rank runs `worker.py`: it holds its shard of the model and mirrors rank 0's engine in lockstep.
Before each engine step rank 0 broadcasts the step's commands (new requests, aborts, runtime
changes) and a sampling seed through `mx.distributed` itself (`channel.py`); every rank then
runs the same `Engine.step()`, whose forwards meet in the model's own collectives (tensor
parallel: `model.shard()`, pipeline: `model.model.pipeline()`).

Modules: `hosts.py` (the hosts file, the ring hostfile, the sharding plan; plain Python),
`channel.py` (the broadcast and the per-rank figures), `wire.py` (the typed messages on the
ring, their HMAC seal and the group's key), `group_engine.py` (`DistributedEngine`, rank
0's engine with the lockstep, the watchdog and the degraded state), `launch.py` (rank 0's
start: spawning the ranks, loading and sharding, the common KV budget), `worker.py` (ranks
1..n-1).
"""
