"""What travels between the hook and the aggregator: the records' types, their JSON encoding and
its version (``records``), and the Kafka client settings both sides read the same way (``kafka``).

Neither side owns it: ``profiler_hook`` writes these records and ``aggregator`` reads them, and
each imports this package, never the other.
"""
