"""Model helpers: tiny offline models (:mod:`qevolve_cli.models.tiny`)."""
