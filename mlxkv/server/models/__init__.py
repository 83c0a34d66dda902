"""Several models behind one server: which one a request names (`served`), which are in
memory and when they load and unload (`resident`), and Ollama's `keep_alive` (`keep_alive`)."""
