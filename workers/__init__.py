"""The workers: Celery app, the generate task, SGLang and cloud backends."""
