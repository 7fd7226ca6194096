"""The engine across processes: the engine in its own process behind the ``EngineClient``
(``process_client`` <-> ``worker`` over ``ipc``: pyzmq + msgpack on unix sockets), tensor-parallel
ranks (``tp``, ``tp_launch``, ``tp_node``, ``tp_worker``) and data-parallel replicas
(``dp_client``, ``dp_router``). Nothing crossing a process boundary is pickled."""
