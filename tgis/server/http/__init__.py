"""The HTTP machinery every API's routes share: the app and its lifecycle, deadlines, errors
and their shapes, server-sent events, request fields and the request contract, the shared
generation path, images, metrics, /info and the OpenAPI document's assembly."""
