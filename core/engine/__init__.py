"""The engine: scheduler, engine loop, model runner (and the tensor-parallel step wire it
broadcasts), sampler, output handling, and the ``EngineClient`` boundary the server talks through;
``procs/`` runs it across processes (engine process, tensor- and data-parallel ranks)."""
