#!/bin/sh
# Sign Strata.app with a Developer ID, notarize it with Apple and staple the ticket (macOS).
#
#   packaging/sign_and_notarize.sh "Developer ID Application: NAME (TEAMID)" [dist/Strata.app]
#
# Notary credentials, either (a) a keychain profile made once with
#   xcrun notarytool store-credentials strata-notary \
#       --apple-id you@example.com --team-id TEAMID --password APP-SPECIFIC-PASSWORD
# and named by NOTARY_PROFILE (default strata-notary), or (b) an App Store Connect API key
# in NOTARY_KEY (path to the .p8), NOTARY_KEY_ID and NOTARY_ISSUER (CI).
# NOTARIZE=0 signs only. See packaging/README.md.
set -eu
IDENTITY=${1:?usage: $0 "Developer ID Application: NAME (TEAMID)" [dist/Strata.app]}
APP=${2:-dist/Strata.app}
HERE=$(cd "$(dirname "$0")" && pwd)
ENTITLEMENTS="$HERE/entitlements.plist"
[ -d "$APP" ] || { echo "sign: $APP not found; run \`make app\` first" >&2; exit 1; }

sign() {
  # Hardened runtime and a secure timestamp: both are required for notarization.
  codesign --force --timestamp --options runtime --entitlements "$ENTITLEMENTS" \
    -s "$IDENTITY" "$1"
}

# Inside out: every Mach-O file first, then framework bundles (deepest first), then the app.
# (codesign --deep signs nested code with the outer code's options, which Apple advises
# against for distribution.)
find "$APP/Contents" -type f | while IFS= read -r f; do
  if file -b "$f" | grep -q "Mach-O"; then sign "$f"; fi
done
find "$APP/Contents" -type d -name "*.framework" | awk '{ print length, $0 }' | sort -rn |
  cut -d" " -f2- | while IFS= read -r fw; do sign "$fw"; done
sign "$APP"
codesign --verify --deep --strict --verbose=2 "$APP"

[ "${NOTARIZE:-1}" = "0" ] && { echo "sign: signed $APP (not notarized)"; exit 0; }

ZIP=$(mktemp -d)/Strata.zip
ditto -c -k --keepParent "$APP" "$ZIP"
if [ -n "${NOTARY_KEY:-}" ]; then
  set -- --key "$NOTARY_KEY" --key-id "${NOTARY_KEY_ID:?}" --issuer "${NOTARY_ISSUER:?}"
else
  set -- --keychain-profile "${NOTARY_PROFILE:-strata-notary}"
fi
OUT=$(xcrun notarytool submit "$ZIP" --wait "$@") || true
echo "$OUT"
if ! echo "$OUT" | grep -q "status: Accepted"; then
  ID=$(echo "$OUT" | awk '/^ *id:/ { print $2; exit }')
  echo "sign: notarization was not accepted; see: xcrun notarytool log $ID $*" >&2
  exit 1
fi
xcrun stapler staple "$APP"
xcrun stapler validate "$APP"
spctl --assess --type execute --verbose=2 "$APP"
echo "sign: $APP is signed, notarized and stapled"
