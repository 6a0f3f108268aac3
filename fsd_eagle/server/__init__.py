"""An OpenAI-compatible HTTP server over ``SpeculativeGenerator`` (``fsd-eagle serve``): ``protocol``
(pydantic request and response models), ``engine`` (the decoding thread, continuous batching across
clients), ``serving_chat`` / ``serving_completion`` (one module per endpoint, on ``serving``), ``metrics``
(Prometheus) and ``app`` (the FastAPI application and ``serve``). Needs the ``serve`` extra: FastAPI,
uvicorn and prometheus-client."""
