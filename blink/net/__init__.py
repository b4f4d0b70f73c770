"""The appliance's network management (`blinkctl net`): declarative profiles (`profile`) applied over netlink
(`apply`). Not part of the gateway: it configures the host the gateway runs on."""
