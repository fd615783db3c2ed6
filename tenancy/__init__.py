"""tenancy package."""
