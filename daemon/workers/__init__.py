"""Engine worker processes behind the HTTP front (`workers.count` > 1).

- `wire`: the messages between the front and a worker (msgspec, over ZMQ IPC sockets);
- `worker`: a worker process: one Engine and the loop serving its sockets;
- `supervisor`: worker placement (devices, threads) and the command that starts one;
- `slot`: one worker slot: its current process and socket, started incarnation by incarnation;
- `pool`: the front's engine proxy (the interface the HTTP layer uses) over all workers, and
  their supervision (a dead worker's streams end, it restarts);
- `aggregate`: one EngineStats from the workers' (admin stats, /metrics).
- `metrics`: the per-worker /metrics series (label worker="i").
"""
