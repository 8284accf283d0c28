"""The pure core of the gateway: limiter, leases, chooser, placement, fingerprint, endpoints, tee.

Standard library and asyncio only, importable without Django settings (import-linter checks it).
"""
