"""Helpers of the documentation build (mkdocs.yml names them): griffe_roles."""
