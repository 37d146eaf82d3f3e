"""Engine worker processes behind the HTTP front (`workers.count` > 1).

- `wire`: the messages between the front and a worker (msgspec, over ZMQ IPC sockets);
- `worker`: a worker process: one Engine and the loop serving its sockets;
- `supervisor`: starts one worker process, notices its death, restarts it;
- `pool`: the front's engine proxy (the interface the HTTP layer uses) over all workers;
- `aggregate`: one EngineStats from the workers' (admin stats, /metrics).
"""
