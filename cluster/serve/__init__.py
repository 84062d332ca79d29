"""HTTP: the Ray Serve app, the OpenAI protocol and service, streaming, errors, ServeConfig."""
