from meshnet_p2p.roles.cli import main

raise SystemExit(main())
