"""The engine: scheduler, engine loop, model runner, sampler, output handling, and the
``EngineClient`` boundary the server talks through."""
