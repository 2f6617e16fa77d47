"""The workers: Celery app, the generate task, the SGLang, vLLM and cloud backends, the engine launcher."""
