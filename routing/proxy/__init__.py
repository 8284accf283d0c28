"""The proxy: the view, what was asked, the request's lifecycle to its row, the body back."""
