"""draftfleet: a Celery + Redis worker fleet for EAGLE-3 draft-model training data."""

__version__ = "0.1.0"
