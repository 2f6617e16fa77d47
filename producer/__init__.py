"""The producer: dataset readers and enqueue."""
