"""The proxy: the view, what was asked, the passage to a host, the body back, the record."""
