"""adapters package."""
