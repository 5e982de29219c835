"""The storage layer: the only package that issues SQL or imports a database driver."""
