"""Generated at build time from proto/ (see setup.py); not edited, not committed."""
