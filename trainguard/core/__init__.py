"""The foundation every stage stands on: the settings table, Kafka settings and topics,
partitioning, the producer of the trainer and the worker, admin calls, topic readers. It
imports no stage (``producers``, ``streams``, ``sinks``) and nothing heavy at import time, so
the trainer side stays light."""
