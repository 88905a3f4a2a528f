"""A served model (vLLM or SGLang): what dflash-regenerate and dflash-eval need to use one.

- :mod:`.settings`: :class:`~.settings.ServerSettings`, the one ``server`` config group
  (conf/server/default.yaml) both commands compose;
- :mod:`.launch`: start a server command for the run and stop it after;
- :mod:`.http`: the JSON request, error detail and served-model choice both clients share;
- :mod:`.completions`: regeneration's client (``/v1/completions`` on token ids, retries);
- :mod:`.engine`: the eval's client (acceptance from vLLM's counters or SGLang's meta_info).
"""
