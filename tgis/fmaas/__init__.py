"""TGIS's gRPC API (`fmaas.GenerationService`) over the same engine as the HTTP routes.

generation.proto is the project's own copy of TGIS's messages (same package, names and field
numbers); generation_pb2*.py are generated from it by grpcio-tools (`make grpc-stubs`).
`convert` holds TGIS's request semantics and validation, `service` the four methods,
`server` the grpc.aio server (health, reflection, TLS).
"""
