"""Files & Batches: the storage contract, batch-file validation, the batch runner (online and
offline) and the ``/v1/files`` and ``/v1/batches`` routes."""
