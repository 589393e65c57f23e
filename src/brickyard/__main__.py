from brickyard.cli import main

raise SystemExit(main())
