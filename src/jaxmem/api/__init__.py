"""The Python API: every device question `jaxmem`'s commands answer, as a function whose result
a notebook shows (`analyze`: `api/analyze.py`; `maxbatch`: `api/maxbatch.py`). The commands
are thin layers over it."""
