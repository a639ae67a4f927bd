"""The live KV block-map page: ``GET /ui`` and its data endpoints under ``/ui/api/``."""
