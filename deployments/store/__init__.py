"""The server's model store and the model files on machines.

Downloads from the hub into the store on disk (``disk``), what a model's files say of it (``facts``),
the files copied to machines or downloaded there (``machine_files``), the cluster's model source
(``sources``), the server's Hugging Face token (``hub_token``), and the Models pages and API.

Nothing here knows of deployments, copies of models serving, placement or the gateway: those import
the store, never the other way round (pyproject.toml's import contracts hold it).
"""
