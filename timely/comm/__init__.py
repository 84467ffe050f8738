"""Communication between workers: allocators of numbered channels (in-process threads, or processes over
ZeroMQ), the wire framing, worker endpoints, the connection handshake and job secrets.

It knows nothing of timestamps, operators or progress (see :mod:`timely.comm.allocator`).
"""
