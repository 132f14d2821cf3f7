from jaxllm.cli import main

raise SystemExit(main())
