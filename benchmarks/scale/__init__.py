"""How the pipeline holds up at scale: ``pipeline.py`` (hook records of large simulated jobs through
ingest and diagnosis), ``serve.py`` (``rankscope serve`` over many jobs), ``ingest.py`` (the
aggregator's throughput from Kafka), ``cluster.py`` (simulated clusters of up to 100,000 ranks)."""
